"""The NumPy level: mha.Module, mha.attention (+ backward) and mha.KVCache,
against torch in float64 and against each other."""
import copy
import json
import math
import pickle
import struct
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
from conftest import check_close


def f32(r, *shape):
    return r.standard_normal(shape).astype(np.float32)


def torch_mha(m, batch_first=True):
    """torch's nn.MultiheadAttention holding mha.Module m's parameters."""
    c = m.config
    t = torch.nn.MultiheadAttention(
        c["embed_dim"], c["num_heads"], bias=c["bias"],
        add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
        kdim=c["kdim"], vdim=c["vdim"], batch_first=batch_first)
    t.load_state_dict({k: torch.from_numpy(v)
                       for k, v in m.state_dict().items()})
    return t


def randomize(m, r):
    for name, shape in m.parameter_shapes().items():
        m[name] = f32(r, *shape) * 0.4


def write_safetensors(path, tensors, meta=None):
    """A safetensors file written by hand (the format's spec), as an
    independent producer for Module.load."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if meta:
        header["__metadata__"] = meta
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_module_forward_backward_against_torch(rng):
    m = mha.Module(12, 3, kdim=5, vdim=7, add_bias_kv=True, seed=3)
    randomize(m, rng)
    t = torch_mha(m)
    t64 = copy.deepcopy(t).double()
    B, Lq, Lk = 2, 4, 6
    q, k, v = f32(rng, B, Lq, 12), f32(rng, B, Lk, 5), f32(rng, B, Lk, 7)
    block = rng.random((B, Lk)) < 0.3
    block[:, 0] = False
    G = f32(rng, B, Lq, 12)
    out, w = m.forward(q, k, v, key_padding_mask=mha.block(block),
                       need_weights="per_head")
    grads = m.backward(G, q, k, v, key_padding_mask=mha.block(block))
    ref = {}
    for dt, mod in ((torch.float32, t), (torch.float64, t64)):
        ins = [torch.from_numpy(x).to(dt).requires_grad_() for x in (q, k, v)]
        o, ww = mod(*ins, key_padding_mask=torch.from_numpy(block),
                    average_attn_weights=False)
        g = torch.autograd.grad((o * torch.from_numpy(G).to(dt)).sum(),
                                ins + list(mod.parameters()))
        names = ["query", "key", "value"] + [n for n, _ in
                                             mod.named_parameters()]
        ref[dt] = (o, ww, dict(zip(names, g)))
    check_close(out, ref[torch.float32][0], ref[torch.float64][0], 2, "out")
    check_close(w, ref[torch.float32][1], ref[torch.float64][1], 2, "w")
    for n in ("query", "key", "value"):
        check_close(grads[n], ref[torch.float32][2][n],
                    ref[torch.float64][2][n], 3, n, backward=True)
    assert list(grads["params"]) == m.parameter_names()
    for n, g in grads["params"].items():
        check_close(g, ref[torch.float32][2][n], ref[torch.float64][2][n], 3,
                    n, backward=True)


def test_masks_are_typed(rng):
    m = mha.Module(8, 2)
    x = f32(rng, 1, 3, 8)
    b = np.zeros((3, 3), bool)
    with pytest.raises(TypeError, match="kind"):
        m.forward(x, attn_mask=b)
    b[0, 1:] = True
    blocked = m.forward(x, attn_mask=mha.block(b))
    allowed = m.forward(x, attn_mask=mha.allow(~b))
    additive = m.forward(x, attn_mask=np.where(b, -np.inf, 0).astype(
        np.float32))
    np.testing.assert_array_equal(blocked, allowed)
    np.testing.assert_allclose(blocked, additive, rtol=0, atol=1e-7)
    causal = m.forward(x, causal="top_left")
    np.testing.assert_allclose(causal, m.forward(
        x, attn_mask=mha.block(np.triu(np.ones((3, 3), bool), 1))),
        rtol=1e-6, atol=1e-7)


def test_save_load_and_torch_file(tmp_path, rng):
    m = mha.Module(8, 2, add_zero_attn=True, dropout=0.25, seed=9)
    randomize(m, rng)
    p = tmp_path / "m.safetensors"
    m.save(p)
    m2 = mha.Module.load(p)
    c1, c2 = m.config, m2.config
    assert c2.pop("seed") == 0 and c1.pop("seed") == 9   # not in the file
    assert c2 == c1 and c2["dropout"] == 0.25
    for n in m.parameter_names():
        np.testing.assert_array_equal(m2[n], m[n])
    # a state_dict written by hand (no metadata): the heads must be given
    t = torch.nn.MultiheadAttention(8, 4, kdim=3, vdim=5)
    q = tmp_path / "t.safetensors"
    write_safetensors(q, {k: v.numpy() for k, v in t.state_dict().items()})
    with pytest.raises(mha.MhaError):
        mha.Module.load(q)
    m3 = mha.Module.load(q, num_heads=4)
    assert m3.num_heads == 4 and m3.kdim == 3 and m3.vdim == 5
    x, kk, vv = f32(rng, 2, 3, 8), f32(rng, 2, 4, 3), f32(rng, 2, 4, 5)
    ref = t(*(torch.from_numpy(a).transpose(0, 1) for a in (x, kk, vv)))[0]
    np.testing.assert_allclose(m3.forward(x, kk, vv),
                               ref.transpose(0, 1).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(mha.MhaIOError):
        mha.Module.load(tmp_path / "missing.safetensors", num_heads=2)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(mha.FormatError):
        mha.Module.load(bad, num_heads=2)


def test_attention_chunk_module_file_and_cache(rng, tmp_path):
    """attention_chunk: the module's config says it, its file keeps it,
    and its decoding through a cache (ordinary, and a window cache of W =
    C) equals its one-shot causal forward, which differs from the module
    without chunks past the first chunk."""
    m = mha.Module(16, 4, num_kv_heads=2, attention_chunk=5, seed=3)
    randomize(m, rng)
    assert m.config["attention_chunk"] == 5
    m.save(tmp_path / "c.safetensors")
    m2 = mha.Module.load(tmp_path / "c.safetensors")
    assert m2.config["attention_chunk"] == 5
    x = f32(rng, 2, 12, 16)
    full = m.forward(x, causal="bottom_right")
    np.testing.assert_array_equal(m2.forward(x, causal="bottom_right"), full)
    plain = mha.Module(16, 4, num_kv_heads=2, seed=3)
    plain.load_state_dict(m.state_dict())
    other = plain.forward(x, causal="bottom_right")
    np.testing.assert_array_equal(other[:, :5], full[:, :5])
    assert np.abs(other[:, 5:] - full[:, 5:]).max() > 1e-3
    for window in (0, 5):
        cache = mha.KVCache.for_module(m, 2, 12, window=window)
        steps = [m.forward(x[:, t:t + 1], cache=cache) for t in range(12)]
        np.testing.assert_allclose(np.concatenate(steps, 1), full,
                                   rtol=0, atol=2e-6)
    with pytest.raises(mha.MhaError, match="attention_chunk"):
        mha.Module(16, 4, attention_chunk=-2)


def test_q4_rotated_cache_against_float64(rng):
    """A q4 cache, rotated and not, decodes a module's tokens: its
    attention is the float64 attention on what the cache stores (read back
    in the caller's basis) to float32 rounding, and on keys with an outlier
    channel the rotation at least halves q4's error against the exact
    values."""
    B, H, Hkv, d, L = 2, 4, 2, 64, 96
    k = rng.uniform(-1, 1, (B, L, Hkv * d)).astype(np.float32)
    v = rng.uniform(-1, 1, (B, L, Hkv * d)).astype(np.float32)
    k[..., 5::d] *= 30.0      # an outlier channel in every K head
    q = rng.uniform(-1, 1, (B, 1, H * d)).astype(np.float32)

    def exact(kk, vv):
        kk = kk.astype(np.float64).reshape(B, L, Hkv, d)
        vv = vv.astype(np.float64).reshape(B, L, Hkv, d)
        qq = q.astype(np.float64).reshape(B, 1, H, d)
        g = np.repeat(np.arange(Hkv), H // Hkv)
        s = np.einsum("bqhd,blhd->bhql", qq, kk[:, :, g]) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("bhql,blhd->bqhd", p, vv[:, :, g]).reshape(B, 1, -1)

    errs = {}
    for rotate in (False, True):
        c = mha.KVCache(B, Hkv, d, L, dtype="q4", rotate=rotate)
        assert c.rotate == rotate
        for b in range(B):
            c.append(b, k[b], v[b])
        out = mha.attention(q, num_heads=H, num_kv_heads=Hkv, cache=c)
        ks = np.stack([c.read(b, 0, L)[0] for b in range(B)])
        vs = np.stack([c.read(b, 0, L)[1] for b in range(B)])
        np.testing.assert_allclose(out, exact(ks, vs), rtol=0, atol=2e-5)
        errs[rotate] = np.abs(out - exact(k, v)).max()
    assert errs[True] <= 0.5 * errs[False], errs


def test_attention_value_width(rng):
    """mha.attention with values of another head width: against NumPy's
    float64 attention, forward and backward (by the chain rule written
    out), and the lse."""
    B, H, Hkv, d, dv, Lq, Lk = 2, 4, 2, 12, 20, 5, 7
    q, k = f32(rng, B, Lq, H * d), f32(rng, B, Lk, Hkv * d)
    v, G = f32(rng, B, Lk, Hkv * dv), f32(rng, B, Lq, H * dv)
    out, lse = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                             causal="bottom_right", return_lse=True)
    assert out.shape == (B, Lq, H * dv)
    g = np.repeat(np.arange(Hkv), H // Hkv)
    qq = q.astype(np.float64).reshape(B, Lq, H, d)
    kk = k.astype(np.float64).reshape(B, Lk, Hkv, d)[:, :, g]
    vv = v.astype(np.float64).reshape(B, Lk, Hkv, dv)[:, :, g]
    s = np.einsum("bqhd,bkhd->bhqk", qq, kk) / np.sqrt(d)
    s = np.where(np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq,
                 s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    ls = p.sum(-1, keepdims=True)
    p /= ls
    want = np.einsum("bhqk,bkhd->bqhd", p, vv).reshape(B, Lq, H * dv)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, (m + np.log(ls))[..., 0], rtol=1e-6,
                               atol=1e-6)
    gq, gk, gv = mha.attention_backward(G, q, k, v, num_heads=H,
                                        num_kv_heads=Hkv,
                                        causal="bottom_right")
    assert gv.shape == v.shape and gk.shape == k.shape
    go = G.astype(np.float64).reshape(B, Lq, H, dv)
    dvv = np.einsum("bhqk,bqhd->bkhd", p, go)
    dp = np.einsum("bqhd,bkhd->bhqk", go, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    dqq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dkk = np.einsum("bhqk,bqhd->bkhd", ds, qq)
    sum_groups = (lambda x: x.reshape(B, Lk, Hkv, H // Hkv, -1).sum(3)
                  .reshape(B, Lk, -1))
    np.testing.assert_allclose(gq, dqq.reshape(B, Lq, -1), rtol=0, atol=1e-5)
    np.testing.assert_allclose(gk, sum_groups(dkk), rtol=0, atol=1e-5)
    np.testing.assert_allclose(gv, sum_groups(dvv), rtol=0, atol=1e-5)


def test_cache_of_another_value_width(rng):
    """A KVCache whose values are wider than its keys: appended and read
    d_v wide, and a decoding step on it equals mha.attention on the same
    keys and values (float rounding apart), q4 included against what it
    stores."""
    B, H, Hkv, d, dv, L = 2, 4, 2, 16, 24, 40
    k = f32(rng, B, L, Hkv * d)
    v = f32(rng, B, L, Hkv * dv)
    q = f32(rng, B, 1, H * d)
    want = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                         causal="bottom_right")
    for dtype in ("f32", "q4"):
        c = mha.KVCache(B, Hkv, d, L, dtype=dtype, v_head_dim=dv)
        assert c.v_head_dim == dv
        for b in range(B):
            c.append(b, k[b], v[b])
        ks = np.stack([c.read(b)[0] for b in range(B)])
        vs = np.stack([c.read(b)[1] for b in range(B)])
        assert vs.shape == v.shape
        out = mha.attention(q, num_heads=H, num_kv_heads=Hkv, cache=c)
        assert out.shape == (B, 1, H * dv)
        ref = want if dtype == "f32" else mha.attention(
            q, ks, vs, num_heads=H, num_kv_heads=Hkv, causal="bottom_right")
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        c.append(0, k[0], k[0])


def test_latent_cache_absorbed_decode(rng):
    """MLA absorbed: 8 heads on one latent cache of [c (16), k_rope (8)]
    whose values are c; the decode times W_uv equals the naive attention
    (per-head keys [W_uk c, k_rope], values W_uv c) in float64."""
    H, R, RO, N, DV, L = 8, 16, 8, 12, 10, 50
    c = f32(rng, L, R + RO)
    wuk = f32(rng, H, N, R) * 0.3
    wuv = f32(rng, H, DV, R) * 0.3
    q = f32(rng, H, N + RO)
    cache = mha.KVCache(1, 1, R + RO, L, v_head_dim=R, latent=True)
    cache.append(0, c, None)
    k_back, v_back = cache.read(0)
    np.testing.assert_array_equal(v_back, c[:, :R])
    qa = np.concatenate([np.einsum("hnr,hn->hr", wuk, q[:, :N]),
                         q[:, N:]], 1).astype(np.float32)
    s = 1 / np.sqrt(N + RO)
    out = mha.attention(qa.reshape(1, 1, -1), num_heads=H, cache=cache,
                        scale=s).reshape(H, R)
    got = np.einsum("hdr,hr->hd", wuv.astype(np.float64), out)
    c64 = c.astype(np.float64)
    kn = np.concatenate([np.einsum("hnr,lr->hln", wuk, c64[:, :R]),
                         np.broadcast_to(c64[:, R:], (H, L, RO))], 2)
    vn = np.einsum("hdr,lr->hld", wuv, c64[:, :R])
    sc = np.einsum("hd,hld->hl", q.astype(np.float64), kn) * s
    p = np.exp(sc - sc.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(got, np.einsum("hl,hld->hd", p, vn),
                               rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="None"):
        cache.append(0, c, c)


@pytest.mark.parametrize("dtype,qmax", [("q8", 127), ("q4", 7)])
def test_latent_cache_quantised(rng, dtype, qmax):
    """A q8 or q4 latent cache: the keys it holds (read back) are each
    within half a quantisation step (its block's max|x| / qmax) of the
    appended ones, and its decode is NumPy's float64 attention over those
    keys, the values their first R elements."""
    H, R, RO, L = 8, 40, 8, 70
    c = f32(rng, L, R + RO)
    cache = mha.KVCache(1, 1, R + RO, L, dtype=dtype, v_head_dim=R,
                        latent=True)
    cache.append(0, c, None)
    k_back, v_back = cache.read(0)
    np.testing.assert_array_equal(v_back, k_back[:, :R])
    for b0 in range(0, R + RO, 32):   # the q8 blocks of 32 elements
        blk = c[:, b0:b0 + 32].astype(np.float64)
        step = np.abs(blk).max(1, keepdims=True) / qmax
        assert (np.abs(k_back[:, b0:b0 + 32] - blk) <= step / 2 * (1 + 1e-6)
                ).all()
    q = f32(rng, H, R + RO)
    out = mha.attention(q.reshape(1, 1, -1), num_heads=H,
                        cache=cache).reshape(H, R)
    k64 = k_back.astype(np.float64)
    sc = q.astype(np.float64) @ k64.T / np.sqrt(R + RO)
    p = np.exp(sc - sc.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(out, p @ k64[:, :R], rtol=0, atol=1e-5)


def test_pickle_module(rng):
    m = mha.Module(8, 2, num_kv_heads=1, rope="gptj", window=(3, 0),
                   softcap=5.0, sinks=True, seed=4, attention_chunk=3)
    randomize(m, rng)
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.config == m.config
    x = f32(rng, 2, 5, 8)
    np.testing.assert_array_equal(m2.forward(x), m.forward(x))


def test_attention_gqa_lse_weights_against_torch(rng):
    B, H, Hkv, d, Lq, Lk = 2, 4, 2, 8, 5, 7
    q, k, v = f32(rng, B, Lq, H * d), f32(rng, B, Lk, Hkv * d), \
        f32(rng, B, Lk, Hkv * d)
    G = f32(rng, B, Lq, H * d)
    kl = np.array([7, 4])
    out, w, lse = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                                key_lengths=kl, need_weights="per_head",
                                return_lse=True)
    gq, gk, gv = mha.attention_backward(G, q, k, v, num_heads=H,
                                        num_kv_heads=Hkv, key_lengths=kl)
    allowed = torch.from_numpy(np.arange(Lk)[None, :] < kl[:, None]) \
        .reshape(B, 1, 1, Lk)
    res = {}
    for dt in (torch.float32, torch.float64):
        def heads(a, n):
            return torch.from_numpy(a).to(dt).reshape(B, -1, n, d) \
                .transpose(1, 2).requires_grad_()
        tq, tk, tv = heads(q, H), heads(k, Hkv), heads(v, Hkv)
        o = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=allowed,
                                           enable_gqa=True)
        kr = tk.repeat_interleave(H // Hkv, 1)
        s = (tq @ kr.transpose(-1, -2)) / math.sqrt(d)
        s = s.masked_fill(~allowed, float("-inf"))
        o2 = o.transpose(1, 2).reshape(B, Lq, H * d)
        g = torch.autograd.grad((o2 * torch.from_numpy(G).to(dt)).sum(),
                                [tq, tk, tv])
        g = [gg.transpose(1, 2).reshape(B, -1, gg.shape[1] * d) for gg in g]
        res[dt] = (o2, torch.softmax(s, -1), torch.logsumexp(s, -1), g)
    r32, r64 = res[torch.float32], res[torch.float64]
    check_close(out, r32[0], r64[0], 2, "out")
    check_close(w, r32[1], r64[1], 2, "weights")
    check_close(lse, r32[2], r64[2], 2, "lse")
    for a, b, c, n in zip((gq, gk, gv), r32[3], r64[3], "qkv"):
        check_close(a, b, c, 3, "grad " + n, backward=True)


def test_kv_cache_decode_equals_full_causal_forward(rng):
    m = mha.Module(16, 4, num_kv_heads=2, rope="neox", seed=2)
    randomize(m, rng)
    B, L = 2, 9
    x = f32(rng, B, L, 16)
    full = m.forward(x, causal="bottom_right")
    cache = mha.KVCache.for_module(m, batch=B, capacity=16)
    assert cache.lengths == [0, 0]
    parts = [m.forward(x[:, :4], cache=cache)]          # prefill
    for i in range(4, L):                                # then token by token
        parts.append(m.forward(x[:, i:i + 1], cache=cache))
    np.testing.assert_allclose(np.concatenate(parts, 1), full, rtol=1e-5,
                               atol=1e-6)
    assert cache.lengths == [L, L]
    # rollback and redo the last three tokens
    cache.truncate(0, L - 3)
    cache.truncate(1, L - 3)
    again = m.forward(x[:, L - 3:], cache=cache)
    np.testing.assert_allclose(again, full[:, L - 3:], rtol=1e-5, atol=1e-6)
    k, vv = cache.read(1)
    assert k.shape == (L, 2 * 4) and vv.shape == (L, 2 * 4)
    np.testing.assert_allclose(vv, m.project("value", x[1]), rtol=1e-5,
                               atol=1e-6)
    cache.reset()
    assert cache.lengths == [0, 0]
    with pytest.raises(mha.MhaError):
        m.forward(x[:, :1], x[:, :1], cache=cache)   # a key with a cache


def test_attention_with_cache_equals_attention(rng):
    H, d, L = 2, 4, 6
    q, k, v = f32(rng, 1, L, H * d), f32(rng, 1, L, H * d), \
        f32(rng, 1, L, H * d)
    full = mha.attention(q, k, v, num_heads=H, causal="bottom_right")
    cache = mha.KVCache(1, H, d, capacity=8, dtype="f32")
    cache.append(0, k[0, :L - 1], v[0, :L - 1])
    cache.append(0, k[0, L - 1:], v[0, L - 1:])
    last = mha.attention(q[:, L - 1:], num_heads=H, cache=cache)
    np.testing.assert_allclose(last, full[:, L - 1:], rtol=1e-6, atol=1e-7)
    with pytest.raises(mha.MhaError):
        cache.append(0, k[0, :3], v[0, :3])     # past the capacity
    assert cache.length(0) == L
    f16 = mha.KVCache(1, H, d, capacity=8, dtype="f16")
    f16.append(0, k[0], v[0])
    k16, _ = f16.read(0)
    np.testing.assert_array_equal(k16, k[0].astype(np.float16)
                                  .astype(np.float32))


@pytest.mark.parametrize("page,pool", [(64, 6), (16, 12)])
def test_paged_cache_forks_and_equals_contiguous(rng, page, pool):
    """A PagedKVCache holds and attends what a contiguous KVCache given the
    same operations holds (the same bits); a fork shares the prompt's pages
    (usage counts them once), a full pool raises MemoryError and changes
    nothing, and a NumPy float64 softmax checks one step.  Pages of 16 too:
    a kernel's tile of 64 keys is then read from four pages."""
    m = mha.Module(32, 4, num_kv_heads=2, seed=3)
    randomize(m, rng)
    B, P = 3, 100
    held = -(-P // page)               # the prompt's pages
    paged = mha.PagedKVCache(B, 2, 8, capacity=200, page_size=page,
                             num_pages=pool, dtype="bf16")
    flat = mha.KVCache(B, 2, 8, capacity=200, dtype="bf16")
    prompt = f32(rng, P, 32)     # sequence 0's, projected and appended
    for c in (paged, flat):
        c.append(0, m.project("key", prompt), m.project("value", prompt))
    paged.fork(0, 1)
    paged.fork(0, 2)
    flat.fork(0, 1)
    flat.fork(0, 2)
    u = paged.usage()
    assert u["tokens"] == 3 * P and u["pages_used"] == held  # shared, once
    assert u["bytes"] < u["token_bytes"]
    x = f32(rng, B, 1, 32)
    for step in range(3):              # each sequence its own token
        a = m.forward(x, cache=paged)
        b = m.forward(x, cache=flat)
        np.testing.assert_array_equal(a, b)
        x = f32(rng, B, 1, 32)
    assert paged.usage()["pages_used"] == held + 2  # copies of the last page
    # float64: the last step's attention of sequence 2, head 0, over the
    # keys and values the cache holds (the module's projections aside)
    k, v = paged.read(2)
    q = f32(rng, 1, 1, 4 * 8)
    got = mha.attention(q.repeat(B, 0), num_heads=4, cache=paged)[2, 0, :8]
    s = k[:, :8].astype(np.float64) @ q[0, 0, :8].astype(np.float64)
    w = np.exp(s / np.sqrt(8) - (s / np.sqrt(8)).max())
    want = (w / w.sum()) @ v[:, :8].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    before = paged.usage()
    big = mha.PagedKVCache(1, 2, 8, capacity=200, num_pages=1)
    big.append(0, np.zeros((64, 16), np.float32), np.zeros((64, 16),
                                                           np.float32))
    with pytest.raises(MemoryError, match="pool is full"):
        big.append(0, np.zeros((1, 16), np.float32),
                   np.zeros((1, 16), np.float32))
    assert big.length(0) == 64 and paged.usage() == before
    paged.reset()
    assert paged.usage()["pages_free"] == pool
    with pytest.raises(mha.MhaError, match="onto itself"):
        paged.fork(1, 1)
    with pytest.raises(mha.MhaError, match="page_size 100"):
        mha.PagedKVCache(1, 2, 8, capacity=200, page_size=100)
    with pytest.raises(mha.MhaError, match="page_size 8"):
        mha.PagedKVCache(1, 2, 8, capacity=200, page_size=8)
    assert ("PagedKVCache" in repr(paged)
            and "page_size=%d" % page in repr(paged))


def test_attention_ragged_mixes_prefill_and_decode(rng):
    """One ragged call: sequence 0 a prefill chunk of 20 tokens, 1 one
    decode token, 2 nothing; each sequence's rows equal mha.attention on
    its own cache (bit for bit) and a NumPy float64 softmax."""
    H, d, B = 4, 8, 3
    paged = mha.PagedKVCache(B, 2, d, capacity=128, page_size=64)
    own = [mha.KVCache(1, 2, d, capacity=128) for _ in range(B)]
    held, new = [30, 70, 5], [20, 1, 0]
    ks = [f32(rng, held[b] + new[b], 2 * d) for b in range(B)]
    vs = [f32(rng, held[b] + new[b], 2 * d) for b in range(B)]
    for b in range(B):
        paged.append(b, ks[b], vs[b])
        own[b].append(0, ks[b], vs[b])
    q_start = np.cumsum([0] + new)
    q = f32(rng, q_start[-1], H * d)
    out, lse = mha.attention_ragged(q, q_start, paged, num_heads=H,
                                    return_lse=True)
    assert out.shape == q.shape and lse.shape == (q_start[-1] * H,)
    for b in range(B):
        rows = slice(q_start[b], q_start[b + 1])
        if new[b] == 0:
            continue
        alone, l1 = mha.attention(q[None, rows], num_heads=H, cache=own[b],
                                  return_lse=True)
        np.testing.assert_array_equal(out[rows], alone[0])
        np.testing.assert_array_equal(lse[H * q_start[b]:H * q_start[b + 1]],
                                      l1.reshape(-1))
        # float64: query i of the chunk sees keys up to held + i
        k, v = ks[b].astype(np.float64), vs[b].astype(np.float64)
        for i in range(new[b]):
            for h in range(H):
                g = h // 2
                s = k[:held[b] + i + 1, g * d:(g + 1) * d] @ \
                    q[q_start[b] + i, h * d:(h + 1) * d] / np.sqrt(d)
                w = np.exp(s - s.max())
                want = (w / w.sum()) @ v[:held[b] + i + 1, g * d:(g + 1) * d]
                np.testing.assert_allclose(out[q_start[b] + i,
                                               h * d:(h + 1) * d], want,
                                           rtol=0, atol=2e-6)
    with pytest.raises(mha.MhaError, match="never decrease"):
        mha.attention_ragged(q, [0, 5, 3, 21], paged, num_heads=H)
    with pytest.raises(ValueError, match="batch \\+ 1"):
        mha.attention_ragged(q, [0, 21], paged, num_heads=H)


def test_attention_ragged_share_prefix(rng):
    """share_prefix: three forks of a 130-token prompt read it once
    (cascade); each row within float rounding of the separate reads and
    of a NumPy float64 softmax."""
    H, d, B = 4, 8, 3
    c = mha.PagedKVCache(B, 2, d, capacity=256, page_size=64)
    k, v = f32(rng, 130, 2 * d), f32(rng, 130, 2 * d)
    c.append(0, k, v)
    c.fork(0, 1)
    c.fork(0, 2)
    ks, vs = [], []
    for b in range(B):
        kb, vb = f32(rng, 3 + b, 2 * d), f32(rng, 3 + b, 2 * d)
        c.append(b, kb, vb)
        ks.append(np.concatenate([k, kb]).astype(np.float64))
        vs.append(np.concatenate([v, vb]).astype(np.float64))
    q_start = np.arange(B + 1)
    q = f32(rng, B, H * d)
    on = mha.attention_ragged(q, q_start, c, num_heads=H, share_prefix=True)
    off = mha.attention_ragged(q, q_start, c, num_heads=H)
    np.testing.assert_allclose(on, off, rtol=0, atol=1e-6)
    for b in range(B):
        for h in range(H):
            g = h // 2
            s = ks[b][:, g * d:(g + 1) * d] @ q[b, h * d:(h + 1) * d] / \
                np.sqrt(d)
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ vs[b][:, g * d:(g + 1) * d]
            np.testing.assert_allclose(on[b, h * d:(h + 1) * d], want,
                                       rtol=0, atol=2e-6)



def test_attention_ragged_latent_pages(rng):
    """MLA's latent cache in pages: a ragged step (two forks of a prompt
    and a sequence of its own) returns (T, H*d_v) rows, bit for bit with
    the prefix shared or not up to rounding, each row a NumPy float64
    softmax over the keys with the keys' first d_v elements as values."""
    H, R, RO, B = 4, 16, 8, 3
    dk = R + RO
    c = mha.PagedKVCache(B, 1, dk, capacity=256, page_size=64,
                         v_head_dim=R, latent=True)
    prompt = f32(rng, 140, dk)
    c.append(0, prompt, None)
    c.fork(0, 1)
    c.append(2, f32(rng, 30, dk), None)
    keys = [prompt, prompt, None]
    for b, n in ((0, 3), (1, 1)):
        own = f32(rng, n, dk)
        c.append(b, own, None)
        keys[b] = np.concatenate([keys[b], own])
    keys[2] = c.read(2, 0, 30)[0]
    new = [3, 1, 2]
    q_start = np.cumsum([0] + new)
    q = f32(rng, q_start[-1], H * dk)
    off = mha.attention_ragged(q, q_start, c, num_heads=H)
    on = mha.attention_ragged(q, q_start, c, num_heads=H, share_prefix=True)
    assert off.shape == (q_start[-1], H * R)
    np.testing.assert_allclose(on, off, rtol=0, atol=1e-6)
    for b in range(B):
        k = keys[b].astype(np.float64)
        held = len(k) - new[b]
        for i in range(new[b]):
            for h in range(H):
                s = k[:held + i + 1] @ q[q_start[b] + i, h * dk:(h + 1) * dk]
                w = np.exp((s - s.max()) / np.sqrt(dk))
                want = (w / w.sum()) @ k[:held + i + 1, :R]
                np.testing.assert_allclose(off[q_start[b] + i,
                                               h * R:(h + 1) * R], want,
                                           rtol=0, atol=2e-6)

def test_threads_release_the_gil(rng):
    m = mha.Module(32, 4, seed=1)
    x = f32(rng, 4, 64, 32)
    ref = m.forward(x)
    outs = [None] * 4

    def work(i):
        outs[i] = m.forward(x)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for o in outs:
        np.testing.assert_array_equal(o, ref)


def test_exceptions_carry_libmha_messages(rng):
    with pytest.raises(mha.ConfigError, match="divisible") as e:
        mha.Module(10, 3)
    assert isinstance(e.value, ValueError) and e.value.status == 2
    m = mha.Module(8, 2)
    with pytest.raises(mha.NotFoundError):
        m["nope"]
    w = m["in_proj_weight"]
    w[0, 0] = np.nan
    with pytest.raises(mha.NonFiniteError) as e:
        m["in_proj_weight"] = w
    assert "in_proj_weight" in str(e.value) or "finite" in str(e.value)
    assert np.isfinite(m["in_proj_weight"]).all()   # left unchanged
    x = f32(rng, 1, 3, 8)
    bad = [
        (TypeError, lambda: m.forward(x.astype(np.float64))),
        (TypeError, lambda: m.forward(None)),
        (TypeError, lambda: m.forward("x")),
        (ValueError, lambda: m.forward(x[..., :7])),
        (ValueError, lambda: m.forward(x[None])),
        (ValueError, lambda: m.forward(x, causal="diagonal")),
        (ValueError, lambda: m.forward(x, need_weights="all")),
        (mha.ShapeError, lambda: m.forward(x, attn_mask=np.zeros(
            (2, 2), np.float32))),
        (mha.MhaError, lambda: m.forward(x, key_lengths=[5])),
        (ValueError, lambda: m.backward(np.zeros((1, 2, 8), np.float32), x)),
        (TypeError, lambda: m.forward(x, head_mask=[1, 1])),
        (ValueError, lambda: m.__setitem__("in_proj_bias",
                                           np.zeros(5, np.float32))),
        (ValueError, lambda: mha.attention(x, x, x, num_heads=3)),
        (TypeError, lambda: mha.attention(x, None, x, num_heads=2)),
        (ValueError, lambda: mha.KVCache(1, 2, 4, 8, dtype="f8")),
        (mha.MhaError, lambda: mha.KVCache(0, 2, 4, 8)),
        (ValueError, lambda: mha.KVCache(1, 2, 4, 8).append(
            0, np.zeros((1, 7), np.float32), np.zeros((1, 7), np.float32))),
        (mha.MhaError, lambda: mha.KVCache(1, 2, 4, 8).truncate(0, 3)),
    ]
    for exc, fn in bad:
        with pytest.raises(exc):
            fn()


def test_non_contiguous_is_copied_not_misread(rng):
    m = mha.Module(8, 2, seed=5)
    x = f32(rng, 3, 8, 2)
    xt = x.transpose(0, 2, 1)            # (3, 2, 8), not contiguous
    np.testing.assert_array_equal(m.forward(xt),
                                  m.forward(np.ascontiguousarray(xt)))


def test_prune_heads_equals_head_mask(rng):
    m = mha.Module(24, 4, seed=2)
    randomize(m, rng)
    x = f32(rng, 2, 5, 24)
    keep = [3, 0]
    p = m.prune_heads(keep)
    assert p.num_heads == 2 and p.head_dim == m.head_dim
    mask = np.zeros(4, np.float32)
    mask[keep] = 1
    want = m.forward(x, head_mask=mask)
    np.testing.assert_allclose(p.forward(x), want, rtol=0, atol=1e-5)
    assert np.abs(want - m.forward(x)).max() > 1e-2  # the mask mattered
    # the kept heads' weights, in the order given
    _, w = m.forward(x, need_weights="per_head")
    _, wp = p.forward(x, need_weights="per_head")
    np.testing.assert_allclose(wp, w[:, keep], atol=1e-6)
    for bad in ([], [0, 0], [4], [-1]):
        with pytest.raises(mha.MhaError):
            m.prune_heads(bad)
    with pytest.raises(TypeError):
        m.prune_heads(3)


@pytest.mark.parametrize("seed", range(8))
def test_module_short_way_is_the_same_call(seed):
    """Module.forward with no mask, weights, dropout, head mask, cache or
    positions takes a short way (forward_fast: C reads the shapes from the
    arrays); with anything more, or an array C would have to convert, the
    full one.  The same bits for self-, shared-K/V and cross-attention,
    each causal kind and thread count (the full way taken here by a
    Fortran-ordered copy of the query); and what the short way declines
    still raises the full way's errors."""
    r = np.random.default_rng(700 + seed)
    H = int(r.integers(1, 4))
    E = H * int(r.choice([2, 4, 8]))
    cross = seed % 3 == 2
    kd, vd = (int(r.integers(3, 12)), int(r.integers(3, 12))) if cross \
        else (E, E)
    m = mha.Module(E, H, kdim=kd, vdim=vd, bias=bool(seed % 2),
                   add_bias_kv=seed % 4 == 1, seed=seed)
    B, Lq, Lk = int(r.integers(1, 4)), int(r.integers(1, 7)), \
        int(r.integers(1, 7))
    q = r.standard_normal((B, Lq, E)).astype(np.float32)
    if seed % 3 == 0:
        k = v = None
    elif seed % 3 == 1:
        k, v = r.standard_normal((B, Lk, E)).astype(np.float32), None
    else:
        k = r.standard_normal((B, Lk, kd)).astype(np.float32)
        v = r.standard_normal((B, Lk, vd)).astype(np.float32)
    causal = [None, "top_left", "bottom_right"][seed % 3]
    threads = seed % 3
    short = m.forward(q, k, v, causal=causal, num_threads=threads)
    assert np.array_equal(m.forward(np.asfortranarray(q), k, v,
                                    causal=causal, num_threads=threads),
                          short)
    # the full way with an argument the short way does not take
    full, _ = m.forward(q, k, v, causal=causal, num_threads=threads,
                        need_weights="average")
    assert np.array_equal(full, short)
    with pytest.raises(TypeError, match="float32"):
        m.forward(q.astype(np.float64), k, v)
    with pytest.raises(ValueError, match="causal"):
        m.forward(q, k, v, causal="diagonal")
    with pytest.raises(ValueError, match="last dimension"):
        m.forward(q[..., :-1], k, v)
    with pytest.raises(mha.MhaError):
        m.forward(q, k, v, num_threads=-1)
    if k is not None:
        with pytest.raises(ValueError, match="batch"):
            m.forward(q, np.concatenate([k, k]),
                      None if v is None else np.concatenate([v, v]))


@pytest.mark.parametrize("seed", range(6))
def test_attention_short_way_is_the_same_call(seed):
    """mha.attention with q, k, v alone takes a short way (one positional
    C call); with anything more, the full one.  The same bits, GQA or not,
    a scale or not; and what the short way cannot take (a non-contiguous
    or float64 array, an unbatched one) still goes the full way."""
    r = np.random.default_rng(500 + seed)
    Hkv = int(r.integers(1, 3))
    H = Hkv * int(r.integers(1, 4))
    d = int(r.choice([4, 8, 16]))
    B, Lq, Lk = int(r.integers(1, 3)), int(r.integers(1, 9)), \
        int(r.integers(1, 9))
    q = r.standard_normal((B, Lq, H * d)).astype(np.float32)
    k, v = (r.standard_normal((B, Lk, Hkv * d)).astype(np.float32)
            for _ in range(2))
    scale = None if seed % 2 else 0.3
    short = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                          scale=scale)
    full, lse = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                              scale=scale, return_lse=True)
    assert np.array_equal(short, full)
    # a transposed copy is not C-contiguous: copied by the full way
    kt = np.ascontiguousarray(k.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert np.array_equal(mha.attention(q, kt, v, num_heads=H,
                                        num_kv_heads=Hkv, scale=scale), full)
    assert np.array_equal(mha.attention(q[0], k[0], v[0], num_heads=H,
                                        num_kv_heads=Hkv, scale=scale),
                          full[0])
    with pytest.raises(TypeError, match="float32"):
        mha.attention(q.astype(np.float64), k, v, num_heads=H,
                      num_kv_heads=Hkv)


def test_gemm_backend_follows_mha_gemm():
    """mha.gemm_backend() names the projections' backend; MHA_GEMM forces
    one (read once per process, so each case runs in its own), and an
    unknown one makes the forward raise, naming MHA_GEMM."""
    import os
    import subprocess
    import sys
    assert mha.gemm_backend() in ("onednn", "cblas")
    code = ("import sys, numpy as np, mha\n"
            "print(mha.gemm_backend())\n"
            "m = mha.Module(8, 2)\n"
            "x = np.ones((1, 3, 8), np.float32)\n"
            "try:\n"
            "    m.forward(x)\n"
            "    print('ok')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    def run(value):
        env = dict(os.environ, MHA_GEMM=value)
        r = subprocess.run([sys.executable, "-P", "-c", code], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()
    assert run("cblas") == ["cblas", "ok"]
    bad = run("frob")
    assert bad[0] == "None"
    assert "MHA_GEMM=frob: expected cblas or onednn" in bad[1]
    onednn = run("onednn")
    assert onednn in (["onednn", "ok"], ["None", onednn[1]])
    if onednn[0] == "None":
        assert "built without oneDNN" in onednn[1]
