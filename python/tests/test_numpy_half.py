"""NumPy's float16 and ml_dtypes' bfloat16 arrays through mha.attention and
mha.attention_backward (libmha's 16-bit attention and backward), against
float64 on the rounded inputs within 2x PyTorch 2.13's own error in that
dtype (its SDPA on the same values), as docs/TESTING.md says of every
half-precision path; and 16-bit queries decoding against a KV cache of
every storage type, bitwise the float32 decode on the widened queries,
rounded."""
import ml_dtypes
import numpy as np
import pytest
import torch

import mha

F = torch.nn.functional
DTYPES = [(np.float16, torch.float16),
          (np.dtype(ml_dtypes.bfloat16), torch.bfloat16)]


def _rows(x, heads):
    """(B, L, H*d) -> (B, H, L, d), as torch's SDPA takes it."""
    B, L, E = x.shape
    return x.reshape(B, L, heads, E // heads).transpose(1, 2)


def _as_torch(x, tdt):
    """A 16-bit NumPy array as the torch tensor of the same bits."""
    return torch.from_numpy(x.view(np.int16).copy()).view(tdt)


CASES = [  # B, H, Hkv, Lq, Lk, d, causal, key lengths
    (2, 4, 4, 40, 40, 64, None, False),
    (2, 4, 2, 33, 70, 32, "bottom_right", False),   # GQA, AMX on bf16
    (1, 2, 2, 50, 50, 40, "top_left", False),       # d 40: widened
    (2, 2, 2, 20, 45, 64, None, True),
]


@pytest.mark.parametrize("dt,tdt", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_attention_and_backward_within_twice_torch(dt, tdt, case):
    B, H, Hkv, Lq, Lk, d, causal, lengths = case
    r = np.random.default_rng(3)
    q = r.uniform(-2, 2, (B, Lq, H * d)).astype(dt)
    k = r.uniform(-2, 2, (B, Lk, Hkv * d)).astype(dt)
    v = r.uniform(-3, 3, (B, Lk, Hkv * d)).astype(dt)
    g = r.uniform(-1, 1, (B, Lq, H * d)).astype(dt)
    kl = np.array([Lk - 7, Lk][:B], np.int64) if lengths else None
    out = mha.attention(q, k, v, num_heads=H, num_kv_heads=Hkv,
                        causal=causal, key_lengths=kl)
    gq, gk, gv = mha.attention_backward(g, q, k, v, num_heads=H,
                                        num_kv_heads=Hkv, causal=causal,
                                        key_lengths=kl)
    assert out.dtype == dt and gq.dtype == gk.dtype == gv.dtype == dt
    assert out.shape == q.shape and gk.shape == k.shape

    # torch: the mask of the same problem (key lengths as a boolean mask)
    mask = None
    if causal or lengths:
        mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        if causal:
            off = Lk - Lq if causal == "bottom_right" else 0
            mask &= torch.ones(Lq, Lk, dtype=torch.bool).tril(off)
        if lengths:
            for b in range(B):
                mask[b, :, :, int(kl[b]):] = False

    def run(dtype):
        ts = [_rows(_as_torch(x, tdt).to(dtype), n).requires_grad_()
              for x, n in ((q, H), (k, Hkv), (v, Hkv))]
        o = F.scaled_dot_product_attention(*ts, attn_mask=mask,
                                           enable_gqa=H != Hkv)
        o.backward(_rows(_as_torch(g, tdt).to(dtype), H))
        return [o] + [t.grad for t in ts]

    want = run(torch.float64)
    theirs = run(tdt)
    ours = [_rows(torch.from_numpy(x.astype(np.float64)), n)
            for x, n in ((out, H), (gq, H), (gk, Hkv), (gv, Hkv))]
    for name, o, t, w in zip(("out", "dq", "dk", "dv"), ours, theirs, want):
        err = (o - w).abs().max().item()
        torch_err = (t.double() - w).abs().max().item()
        assert torch_err > 0, name
        assert err <= 2 * torch_err, (name, err, torch_err)


@pytest.mark.parametrize("dt,tdt", DTYPES)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8"])
def test_decode_half_queries_on_every_cache(dt, tdt, kv_dtype):
    r = np.random.default_rng(5)
    B, H, Hkv, d, n0, steps = 2, 4, 2, 32, 30, 3
    c = mha.KVCache(batch=B, num_kv_heads=Hkv, head_dim=d, capacity=64,
                    dtype=kv_dtype)
    for b in range(B):
        c.append(b, r.standard_normal((n0 + b, Hkv * d)).astype(np.float32),
                 r.standard_normal((n0 + b, Hkv * d)).astype(np.float32))
    q = r.uniform(-1, 1, (B, steps, H * d)).astype(dt)
    for b in range(B):   # this step's keys first, then the queries
        c.append(b, r.standard_normal((steps, Hkv * d)).astype(np.float32),
                 r.standard_normal((steps, Hkv * d)).astype(np.float32))
    got, lse = mha.attention(q, num_heads=H, num_kv_heads=Hkv, cache=c,
                             return_lse=True)
    want, lse32 = mha.attention(q.astype(np.float32), num_heads=H,
                                num_kv_heads=Hkv, cache=c, return_lse=True)
    assert got.dtype == dt
    assert np.array_equal(got.view(np.uint16),
                          want.astype(dt).view(np.uint16))
    assert np.array_equal(lse, lse32)


def test_mixed_dtypes_refused():
    q = np.zeros((1, 4, 64), np.float16)
    with pytest.raises(TypeError, match="float16"):
        mha.attention(q, q.astype(np.float32), q, num_heads=2)
    b = q.astype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        mha.attention(b, q, q, num_heads=2)


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_backward_half_with_sinks_and_dropout(dt, tdt):
    """The 16-bit backward with sinks and dropout: each gradient the
    float32 backward's on the widened data, rounded once, and the sinks'
    gradient (float32) the float32 one, bit for bit."""
    r = np.random.default_rng(4)
    q, k, v, go = (r.uniform(-2, 2, (2, 12, 64)).astype(dt) for _ in range(4))
    kw = dict(num_heads=2, sinks=np.array([0.5, -1.0], np.float32),
              dropout=0.2, training=True, dropout_seed=7, causal="top_left")
    got = mha.attention_backward(q, k, v, go, **kw)
    want = mha.attention_backward(*(x.astype(np.float32)
                                    for x in (q, k, v, go)), **kw)
    for g, w in zip(got[:3], want[:3]):
        assert g.dtype == dt
        assert np.array_equal(g.view(np.uint16), w.astype(dt).view(np.uint16))
    assert got[3].dtype == np.float32 and np.array_equal(got[3], want[3])


@pytest.mark.parametrize("dt,tdt", DTYPES)
def test_module_half_within_twice_torch(dt, tdt):
    """mha.Module on 16-bit arrays (forward and backward) against torch's
    module in float64 on the rounded values, within 2x the error of
    torch's own module moved to the dtype."""
    m = mha.Module(64, 4, seed=2)
    r = np.random.default_rng(9)
    state = {}
    for name, shape in m.parameter_shapes().items():   # 16-bit values
        state[name] = r.uniform(-0.3, 0.3, shape).astype(dt).astype(np.float32)
        m[name] = state[name]
    x = r.uniform(-1, 1, (2, 11, 64)).astype(dt)
    g = r.uniform(-1, 1, (2, 11, 64)).astype(dt)
    out = m.forward(x, causal="top_left")
    grads = m.backward(g, x, causal="top_left")
    assert out.dtype == dt and grads["query"].dtype == dt

    mask = torch.ones(11, 11, dtype=torch.bool).triu(1)

    def run(dtype):
        t = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        t.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        t = t.to(dtype)
        xx = _as_torch(x, tdt).to(dtype).requires_grad_()
        o = t(xx, xx, xx, need_weights=False, attn_mask=mask)[0]
        o.backward(_as_torch(g, tdt).to(dtype))
        return [o, xx.grad, t.in_proj_weight.grad, t.out_proj.weight.grad]

    want = run(torch.float64)
    theirs = run(tdt)
    ours = [torch.from_numpy(out.astype(np.float64)),
            torch.from_numpy(grads["query"].astype(np.float64)),
            torch.from_numpy(grads["params"]["in_proj_weight"].astype(
                np.float64)),
            torch.from_numpy(grads["params"]["out_proj.weight"].astype(
                np.float64))]
    for name, o, t, w in zip(("out", "dx", "dW_in", "dW_out"), ours, theirs,
                             want):
        err = (o - w).abs().max().item()
        torch_err = (t.double() - w).abs().max().item()
        assert torch_err > 0, name
        assert err <= 2 * torch_err, (name, err, torch_err)
