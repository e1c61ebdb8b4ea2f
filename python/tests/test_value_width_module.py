"""Modules whose values are v_head_dim wide beside queries and keys of
embed_dim / num_heads (DeepSeek's MLA: values of 128 beside 192), from
torch (mha.nn.MultiheadAttention(..., v_head_dim=)) and NumPy
(mha.Module(..., v_head_dim=)): outputs, weights and every gradient
against the same module written here in torch's own ops, in float64, within
2x (3x for gradients) the error of those ops in float32 (conftest's
check_close); the bf16 module against float64 on its rounded values
within 2x torch's bf16 ops; parameter shapes; a libmha file round trip;
a KV cache decode equal to the causal forward; refusals."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mha
import mha.nn as mnn
from conftest import check_close

# E, H, v_head_dim, kdim, vdim, bias, add_bias_kv, add_zero_attn, cross
CASES = [
    (8, 2, 6, None, None, True, False, False, False),    # d_v 6 > d_h 4
    (12, 3, 2, None, None, True, True, True, False),     # d_v 2 < d_h 4
    (8, 2, 5, 5, 7, False, True, False, True),           # cross, no bias
    (16, 4, 3, 6, 6, True, False, True, True),
]


def reference(p, q, k, v, H, dv, bias_kv, zero_attn, kpm):
    """The module in torch ops (batch first): projections, the extra
    key/value rows, SDPA with values of width dv, the output projection.
    Returns the output and the head-averaged weights."""
    B, Lq, E = q.shape
    dh = E // H
    b = p.get("in_proj_bias")
    bq, bk, bv = (None,) * 3 if b is None else (b[:E], b[E:2 * E],
                                                 b[2 * E:])
    Q = F.linear(q, p["q_proj_weight"], bq)
    K = F.linear(k, p["k_proj_weight"], bk)
    V = F.linear(v, p["v_proj_weight"], bv)
    pad = kpm
    if bias_kv:
        K = torch.cat([K, p["bias_k"].expand(B, 1, E)], 1)
        V = torch.cat([V, p["bias_v"].expand(B, 1, H * dv)], 1)
        pad = F.pad(pad, (0, 1))
    if zero_attn:
        K = torch.cat([K, K.new_zeros(B, 1, E)], 1)
        V = torch.cat([V, V.new_zeros(B, 1, H * dv)], 1)
        pad = F.pad(pad, (0, 1))
    Lt = K.shape[1]
    Q = Q.view(B, Lq, H, dh).transpose(1, 2)
    K = K.view(B, Lt, H, dh).transpose(1, 2)
    V = V.view(B, Lt, H, dv).transpose(1, 2)
    S = Q @ K.transpose(-1, -2) / dh ** 0.5
    S = S.masked_fill(pad[:, None, None, :], float("-inf"))
    P = torch.softmax(S, -1)
    O = (P @ V).transpose(1, 2).reshape(B, Lq, H * dv)
    return F.linear(O, p["out_proj.weight"], p.get("out_proj.bias")), \
        P.mean(1)


def setup(case, seed):
    E, H, dv, kdim, vdim, bias, bkv, za, cross = case
    r = np.random.default_rng(seed)
    m = mnn.MultiheadAttention(E, H, bias=bias, add_bias_kv=bkv,
                               add_zero_attn=za, kdim=kdim, vdim=vdim,
                               batch_first=True, v_head_dim=dv)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.from_numpy(
                r.standard_normal(p.shape).astype(np.float32) * 0.4))
    B, Lq = 2, 5
    Lk = 6 if cross else Lq

    def t(*s):
        return torch.from_numpy(r.standard_normal(s).astype(np.float32))
    q = t(B, Lq, E)
    k, v = (t(B, Lk, kdim or E), t(B, Lk, vdim or E)) if cross else (q, q)
    kpm = torch.from_numpy(r.random((B, Lk)) < 0.3)
    kpm[:, 0] = False   # every row keeps a key
    return m, q, k, v, kpm


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E%d H%d dv%d" % c[:3])
def test_module_against_torch_ops(case):
    E, H, dv, kdim, vdim, bias, bkv, za, cross = case
    m, q, k, v, kpm = setup(case, 7)
    Dv = H * dv
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["v_proj_weight"] == (Dv, vdim or E)
    assert shapes["out_proj.weight"] == (E, Dv)
    if bias:
        assert shapes["in_proj_bias"] == (2 * E + Dv,)
    if bkv:
        assert shapes["bias_v"] == (1, 1, Dv)
    G = torch.from_numpy(np.random.default_rng(8).standard_normal(
        (q.shape[0], q.shape[1], E)).astype(np.float32))

    def run(fn, dtype, params):
        ins = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, w = fn(*ins, params)
        grads = torch.autograd.grad((out * G.to(dtype)).sum(),
                                    ins + list(params.values()))
        return out, w, grads

    def ours(qq, kk, vv, params):
        return m(qq, kk, vv, key_padding_mask=kpm, need_weights=True)

    def torch_ops(dtype):
        params = {n: p.detach().to(dtype).requires_grad_()
                  for n, p in m.named_parameters()}
        return run(lambda qq, kk, vv, p: reference(
            p, qq, kk, vv, H, dv, bkv, za, kpm), dtype, params)

    o, w, g = run(ours, torch.float32, dict(m.named_parameters()))
    o32, w32, g32 = torch_ops(torch.float32)
    o64, w64, g64 = torch_ops(torch.float64)
    check_close(o, o32, o64, 2, "out")
    check_close(w, w32, w64, 2, "weights")
    names = ["query", "key", "value"] + [n for n, _ in m.named_parameters()]
    for n, a, b, c in zip(names, g, g32, g64):
        check_close(a, b, c, 3, "grad " + n, backward=True)


def test_bf16_module_within_twice_torch_ops():
    """The module moved to bfloat16: libmha's 16-bit forward and backward
    against float64 on the rounded values, within 2x the error of the same
    torch ops run in bfloat16."""
    case = (64, 2, 48, None, None, True, False, False, False)
    m, q, _, _, _ = setup(case, 11)
    m = m.to(torch.bfloat16)
    qb = q.to(torch.bfloat16)
    no_pad = torch.zeros(q.shape[0], q.shape[1], dtype=torch.bool)
    G = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def grads(fn, dtype, params):
        x = qb.detach().to(dtype).requires_grad_()
        out = fn(x, params)
        g = torch.autograd.grad((out * G.to(dtype)).sum(),
                                [x] + list(params.values()))
        return out, g

    def ref(dtype):
        params = {n: p.detach().to(dtype).requires_grad_()
                  for n, p in m.named_parameters()}
        return grads(lambda x, p: reference(p, x, x, x, 2, 48, False, False,
                                            no_pad)[0], dtype, params)

    o, g = grads(lambda x, p: m(x, x, x, need_weights=False)[0],
                 torch.bfloat16, dict(m.named_parameters()))
    o16, g16 = ref(torch.bfloat16)
    o64, g64 = ref(torch.float64)
    assert o.dtype == torch.bfloat16
    check_close(o.float(), o16.float(), o64, 2, "bf16 out")
    for a, b, c in zip(g, g16, g64):
        check_close(a.float(), b.float(), c, 2, "bf16 grad", backward=True)


def test_numpy_module_file_and_cache(tmp_path):
    """mha.Module with v_head_dim: its forward is mha.nn's on the same
    parameters (one library, the same bits); a file round trip keeps the
    widths and the bits; a KV cache shaped for it decodes token by token
    what the causal forward computes."""
    E, H, dv = 16, 4, 6
    nm = mha.Module(E, H, num_kv_heads=2, v_head_dim=dv, seed=3)
    assert nm.v_head_dim == dv and nm.head_dim == 4
    assert nm.parameter_shapes()["v_proj_weight"] == (2 * dv, E)
    assert nm.parameter_shapes()["out_proj.weight"] == (E, H * dv)
    r = np.random.default_rng(5)
    for n, s in nm.parameter_shapes().items():
        nm[n] = r.standard_normal(s).astype(np.float32) * 0.3
    x = r.standard_normal((2, 9, E)).astype(np.float32)
    full = nm.forward(x, causal="bottom_right")
    assert nm.project("value", x[0]).shape == (9, 2 * dv)
    path = tmp_path / "dv.safetensors"
    nm.save(path)
    back = mha.Module.load(path)
    assert (back.head_dim, back.v_head_dim, back.num_kv_heads) == (4, dv, 2)
    assert np.array_equal(back.forward(x, causal="bottom_right"), full)
    cache = mha.KVCache.for_module(nm, 2, 16)
    assert cache.v_head_dim == dv
    steps = [nm.forward(x[:, :4], cache=cache)]
    steps += [nm.forward(x[:, i:i + 1], cache=cache) for i in range(4, 9)]
    dec = np.concatenate(steps, 1)
    # two float32 computations of one attention (tiles against one row)
    assert np.abs(dec - full).max() <= 1e-5 * (1 + np.abs(full).max())


def test_refusals():
    with pytest.raises(ValueError, match="v_head_dim must be >= 1"):
        mnn.MultiheadAttention(8, 2, v_head_dim=0)
    with pytest.raises(TypeError, match="v_head_dim must be an integer"):
        mnn.MultiheadAttention(8, 2, v_head_dim=2.5)
    with pytest.raises(mha.MhaError, match="v_head_dim"):
        mha.Module(8, 2, v_head_dim=-3)
    # a cache of the keys' width for a module of d_v 6: refused by name
    nm = mha.Module(8, 2, v_head_dim=6)
    cache = mha.KVCache(1, 2, 4, 8)
    with pytest.raises(mha.MhaError, match="the cache's values are 4 wide"):
        nm.forward(np.zeros((1, 1, 8), np.float32), cache=cache)
